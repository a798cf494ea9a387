"""Reading a run back for a person: `dskit status` (any target, Kubernetes pods), `dskit report`, and
`dskit plan --explain`."""
