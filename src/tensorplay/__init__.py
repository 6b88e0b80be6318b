"""tensorplay: the tensorplay.distributed package lives here."""
