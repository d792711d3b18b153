"""After a verified merge: upload to the Hugging Face Hub, cleanup of training leftovers."""
