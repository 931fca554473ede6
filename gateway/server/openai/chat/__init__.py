"""POST /v1/chat/completions and POST /v1/completions.

Messages are rendered with the model's chat template by the engine adapter (with the tools,
when the call offers some); `stream` answers with `data:` chunks then `data: [DONE]`, with a
usage chunk when stream_options.include_usage is set; a client that disconnects from a
stream cancels the generation.

- n > 1: n ordinary requests admitted together (all or none), each with its own seed (the
  call's seed + i, else random ones), their usage summed; streamed chunks carry each
  choice's index.
- logprobs / top_logprobs (engine contract): from the record's outputs.logprobs; streamed,
  a choice's log-probabilities come with its last chunk (the one with finish_reason).
- response_format json_object / json_schema: guided decoding on the engine (the output is
  valid JSON, of the schema).
- tools / tool_choice: auto offers the tools and reads the calls from the text in the
  format of the model's template family (gateway.server.llm.tools; streamed: text that may
  begin a call is held back, a call goes out whole); required or a named function forces one
  call by guided decoding (a call cut by max_tokens is still a call, finish_reason length);
  none offers no tools. A call ends the choice with finish_reason tool_calls.
- sampling: OpenAI's defaults (openai_sampling); stop sequences are matched on the text by
  the engine adapter (gateway.server.llm.stops) and left out of it.
- service_tier: flex runs in the batch band with a long deadline, priority in the high
  band; the answer says which ran (auto and default: default).
- prompt_cache_key: routing affinity (requests with the same key prefer the same replica).

The package's modules, lowest first: plan.py (the core's plan of a chat completion's tools,
tool choice, logprobs and tier), requests.py (a body as the core's call, LlmCall, and so as
the ordinary requests behind it), objects.py (the completion objects from records),
chunks.py (the streamed chunks: ChunkStream), routes.py (the router). The Batch API uses
the requests and the objects; the other doors map onto gateway.server.calls themselves."""

from gateway.server.openai.chat.chunks import ChunkStream, Pads
from gateway.server.openai.chat.objects import chat_completion, completion_logprobs, text_completion
from gateway.server.openai.chat.plan import chat_plan
from gateway.server.openai.chat.requests import chat_request, completion_request
from gateway.server.openai.chat.routes import router

__all__ = [
    "ChunkStream",
    "Pads",
    "chat_completion",
    "chat_plan",
    "chat_request",
    "completion_logprobs",
    "completion_request",
    "router",
    "text_completion",
]
