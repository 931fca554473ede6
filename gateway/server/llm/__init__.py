"""The gateway's own tokens for LLMs on the engine path: the model's Hugging Face
tokenizer and chat template (tokenizer.py), and incremental detokenization that emits
only whole characters (detokenizer.py)."""
