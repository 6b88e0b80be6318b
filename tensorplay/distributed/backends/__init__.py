"""One module per engine; each is the only importer of its engine."""
