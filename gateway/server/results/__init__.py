"""Handing outcomes back: reading a request's record or live state, waking long-polls
the moment a request ends, and feeding Server-Sent Events from the event streams."""
