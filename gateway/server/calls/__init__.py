"""The core every LLM door maps onto: a call already in the gateway's terms (messages,
tools, sampling, stops, output shape, tier) as ordinary durable requests, and those
requests run: submitted, waited for, followed, their records read and their usage summed.

The doors (/v1 chat and completions, Responses and the Batch API under
gateway.server.openai, the Messages API under gateway.server.anthropic) map their API's
shapes in and out and import this package, never each other.

Its modules, lowest first: terms.py (a body's fields honoured or refused by name, the chat
messages, the tier, the plan of tools and how an output is read), requests.py (the model a
call names and what its contract can do; a call, LlmCall, as its requests), run.py
(submitting, waiting, following, the records and their usage)."""
