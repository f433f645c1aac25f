"""meshnode's protocol core. It contains no networking, file, clock or process code at all:
every input (messages, time, randomness) is passed in, every output is returned."""
