"""SAP as a service: the vendor's fine-tuning server and the customer's client, over HTTP (see docs/sap.md)."""
