"""The HTTP API, one router per concern; request parsing and error mapping beside them."""
