"""Chat renderers; importing the package registers every renderer."""
