"""Who is asking: the key by which fair admission shares the streams among callers."""


def client_key(session: str | None, address: str | None) -> str | None:
    """``ui:<session>`` for a page that sent its browser session id, else ``api:<address>`` for the
    caller's network address, so that a script calling the UI's endpoints and the HTTP API from one
    host counts as one client however many connections it opens. None when neither is known (the
    request then counts as a client of its own). Behind a reverse proxy every API caller shares
    the proxy's address."""
    if session:
        return f"ui:{session}"
    return f"api:{address}" if address else None
