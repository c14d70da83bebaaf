"""Mosaic inside other training engines. Each integration imports its engine lazily: importing
``mosaic`` (or ``mosaic.core``) never imports one."""
