"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over
the same durable requests as the rest: a call is mapped onto the chat path
(gateway.server.openai.chat) and answered in Anthropic's shapes, its errors too."""
