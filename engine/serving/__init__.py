"""engine.serving: mlx-lm's own OpenAI-compatible server with a two-tier prompt cache.

Nouns:
  ServingSettings    frozen settings of the store tier: namespace, lookup deadline,
                     publish policy (segment types, minimum length, second sighting,
                     byte budget), write-behind queue cap.
  ModelFingerprint   who the served model is: model id (name @ weights digest) and the
                     tokenizer fingerprint, from the files mlx-lm loads.
  StoreTier          L2: the adapter between the server and this engine. Every call into
                     engine restore/publish/write-behind is in engine/serving/store_cache.py
                     and nowhere else, so an engine signature change touches one file.
  TwoTierPromptCache mlx-lm's LRUPromptCache (L1, in memory) that falls back to a
                     StoreTier (L2) on a miss or a shorter match, and offers what it
                     inserts to the StoreTier for publication.
  ServingMetrics     counters behind /metrics and the per-request log line.

engine/serving/mlx_server.py installs these into mlx_lm.server (a replaced run()) after
checking that the installed mlx-lm has the hooks this code was written against.
"""
