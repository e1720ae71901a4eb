"""The Realtime server: the protocol (:mod:`.protocol`, pure), the FastAPI app (:mod:`.app`)."""
