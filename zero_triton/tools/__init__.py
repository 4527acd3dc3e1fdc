"""The command line and the tools around the library (demo, bench, profile, memory,
checkpoint, a GPT, a reference step). They import the library; the library never imports
them."""
