"""`dskit status` and `dskit report` (dskit/status/)."""
