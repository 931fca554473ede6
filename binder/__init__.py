"""The binder (`binder run`): stores every result the dispatchers publish in MongoDB
(archive.py), keeps the vector index of their embeddings (index/), and sends webhooks
(webhooks/); a small internal HTTP API (app.py) serves search and replay to gateways."""
