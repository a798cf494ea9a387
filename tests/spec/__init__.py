"""The run spec and the catalogs: loading, validation, hostile input (dskit/spec/, dskit/catalog/)."""
