"""The OpenAI-compatible API under /v1, on the durable pipeline: every call is an
ordinary request underneath (a request id, a record in /results/<id> and MongoDB,
embeddings in the index, metrics), shaped the way OpenAI's API reference shapes it.
Unknown fields are accepted and ignored, as OpenAI's SDKs expect."""
