"""The header that carries the internal secret from the proxy to the server (``INTERNAL_SECRET`` in both
environments): the server answers only requests that carry it, so nothing on the network reaches the model
around the proxy's token check. One definition for both packages."""

INTERNAL_HEADER = "X-Internal-Secret"
