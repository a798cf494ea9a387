"""Helpers the tests share: clusters on network namespaces, golden cases, reference models, data."""
