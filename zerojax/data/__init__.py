"""Training text: files or the embedded corpus (`corpus/`), tokenised, packed into batches."""
