"""What the pass did, in the user's words: the report, its builder, the printed graph, the picture, ``explain``."""
