"""What the tests share: servers on loopback (the scripted OpenAI upstream's fixtures, the scripted
summarizer endpoint, llama.cpp's server), the command run in process, generated and real traces, and plain
reference implementations the C++ core is checked against. Imported as ``helpers.<module>``."""
