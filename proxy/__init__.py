"""The JWT reverse proxy: checks a bearer token on every request and streams the upstream answer through.

Run it with ``python -m proxy``; see docs/proxy.md.
"""
