"""Tracing: the recorder that keeps every command, completion and block transition, the
tools that turn a trace into Chrome trace-event JSON or the HTML viewer, and the viewer
itself (trace_view.html).

Owns the trace's record format and its readers.  May import statekv only, so that any layer
can record into it; the actors and facades import it.
"""
