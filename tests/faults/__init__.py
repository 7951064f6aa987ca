"""Fault injection for outbox-relay: ``python -m tests.faults --seconds 120 --faults 50``.

Real ``outbox-relay run`` processes, real PostgreSQL and a real Kafka-protocol broker (Tansu),
faults injected from outside (process kills and stops, broker and database restarts, connections
cut or stalled at TCP proxies, backends terminated), a recorder consuming the topic, and a checker
of no loss, no phantoms, per-key order after de-duplication, duplicate rate and recovery per fault.
bench/results/2026-11-23-faults.md has the results of a full run and says how to read them.

Modules: ``run`` (one run, start to finish), ``cluster`` (the servers and relay processes),
``faults`` (the injectors and the plan), ``proxy`` (the TCP proxy), ``producer`` (a producer
process), ``recorder`` (the topic consumer), ``checker`` (the verdict, pure), ``report`` (markdown).
"""
