"""Graph passes. See README.md in this folder for the invariants every pass keeps."""
