"""The Files and Batch APIs: files.py and batches.py (routes), store.py and
batch_store.py (MongoDB, below the routes: gateway.server.services names their classes),
batch_runner.py (every gateway's runner of batches). This module imports none of them."""
