"""The Responses API (create.py routes): POST /v1/responses, GET /v1/responses/{id} (optionally streamed,
resuming with starting_after), GET /v1/responses/{id}/input_items, DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel. Objects and events as OpenAI and the
Open Responses specification define them: every field of a response present (null where
it does not apply), each streamed event with its sequence_number and whole objects.

- Status: `queued` while the request waits for a slot, `in_progress` while it runs, then
  `completed`, `incomplete` (max_output_tokens ran out), `failed` or `cancelled`. A
  background create answers `queued` at once; a foreground stream begins in_progress.
- background=true: an ordinary durable request that survives the client's disconnect and
  a gateway restart. Streamed events get sequence numbers derived from the request's own
  event stream (which only grows), so resuming after sequence number N gives exactly what
  followed N.
- Function tools (`tools`, `tool_choice`, `parallel_tool_calls`, `max_tool_calls`) as on
  chat completions (gateway.server.llm.tools; the chat package's plan): auto reads calls from the
  text in the model's template family, required or a named function forces one call by
  guided decoding. Calls are `function_call` output items (streamed with
  response.function_call_arguments.delta/.done); text outside them is a message (with
  tools offered, its leading white space, and its trailing white space before a call, are
  left out). `function_call` and `function_call_output` input items are the calls and the
  caller's results; earlier output items given back as input (ids, statuses) are taken
  as they are, so `input = history + response.output` works.
- Conversation state (store.py; chains.py reads it back): a stored response keeps its settings and input
  items in MongoDB with its tenant; `previous_response_id` continues it (its input and
  output items, and those of the chain before it, come first; its instructions do not),
  across gateways and restarts. `store: false` keeps nothing of the response (it cannot be
  read back or continued). input_items lists what the model was given. `conversation`
  (conversations.py) gives a response a conversation's items and adds its own to it.
- text.format json_object / json_schema is guided decoding on the engine; include
  message.output_text.logprobs (and top_logprobs) puts each token's log-probability in the
  output text; service_tier and prompt_cache_key work as on chat completions; usage has
  input_tokens_details.cached_tokens. A background response that ends is announced to the
  tenant's OpenAI webhook endpoint (the binder sends response.completed and the others).
- max_output_tokens reports the cap that applied: the one given, else the gateway's default
  (512), so a response cut by either (`incomplete_details.reason: max_output_tokens`)
  names its number.
- A function_call_output must answer a function_call before it (in the input, the chain or
  the conversation): 400 naming input[i].call_id otherwise.
- POST /v1/responses/compact (compact.py) and WebSocket mode (GET /v1/responses
  upgraded: websocket.py) are routers of their own beside create.py's. A `compaction` input item is the
  summary compact made, kept for the tenant (compactions.py).
- Refused by name (400): other tool types, image input (no image model serves /v1) and
  file input, `reasoning`, `truncation: auto`, `prompt`.

The package's modules, lowest first: settings.py (what a response echoes, its id and
status), items.py (input and output items), objects.py (the response object), events.py
(stream events), store.py and compactions.py (MongoDB), chains.py (previous_response_id
chains and conversations read back), call.py (a create call as a request, kept), then the
routers: create.py, compact.py, websocket.py, conversations.py. This module imports none
of them: app.py includes each router."""
