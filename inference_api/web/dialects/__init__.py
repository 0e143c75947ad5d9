"""The request dialects the server speaks, one package each (docs/dialects.md): ``protocol`` parses a body into
a request (transport-free, raising ``request_errors``), ``format`` turns the engine's events into the dialect's
wire format, ``routes`` is its Flask blueprint over the one ``Serving``, with its API family fixed once where
the blueprint is made (``http.family_blueprint``). ``shared`` serves the paths two dialects share, told apart
by the body.
"""
