"""The file formats a dataset may come in: table files by suffix, and image files."""

#: Table files ``datasets`` reads, by suffix: the builder that reads them.
FILE_BUILDERS = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
}
#: Image files (an image folder's, or ``fedavg predict``'s inputs), by suffix.
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
