"""omnirl reward plugin: OCR accuracy of the text a prompt asks for (RapidOCR, offline models)."""
