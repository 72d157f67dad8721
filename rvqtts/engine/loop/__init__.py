"""The loops: the frame loop (talker, c0) over batch rows, and the inner loop (c1..c15) per frame."""
