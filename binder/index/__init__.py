"""The vector index (vectors.py: FAISS, one index per embedding space, snapshots) and its
follower (follower.py: fed from the results stream, rebuilt from MongoDB)."""
