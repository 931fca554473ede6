"""Choosing a replica for each request: for LLMs, a cost that weighs the prompt blocks a
replica would have to prefill (a prefix index shared by all gateways) against its live
load (the engines' metrics, scraped); for other models, the least loaded replica."""
