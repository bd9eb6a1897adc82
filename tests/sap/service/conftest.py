"""The SAP service tests' keys (the vendor's model folder, ``vendor_model``, is a fixture of tests/conftest.py)."""

KEYS = ("key-acme", "key-globex")
