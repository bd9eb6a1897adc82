"""The vendor's routes and media type, shared by the server and the client."""

SESSIONS_PATH = "/v1/sap/sessions"
SAP_MESSAGE = "application/vnd.privlm.sap+safetensors"  # a SAP message: safetensors with its fields in the metadata
MULTIPLEX_HEADER = "serve_multiplexed_model_id"  # Ray Serve routes by it: the session id, to its replica
