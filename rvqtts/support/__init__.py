"""What every layer uses: files written whole, the measurement cache, memory, audio files, the tables people read."""
