"""Model code: the target decoder, the MTP modules, and checkpoint loading."""
