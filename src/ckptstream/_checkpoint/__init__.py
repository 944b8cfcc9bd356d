"""The checkpoint API: save, save_async and its capture, load, load_into, the reader, the mapped
load, the transfer primitive."""
