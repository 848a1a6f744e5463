"""Issue 8's reliability and security suite: crash loops, fault injection, damage
sweeps, exhaustion and hostile input. Every test prints `METRIC ...` lines; the soak
tier (KVSTORE_SOAK=1) runs the same code longer. docs/reliability.md has the figures."""
