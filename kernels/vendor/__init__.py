"""Third-party kernel code kept as its authors wrote it, each library in its own folder with its licence and a README
naming the release and the files taken: lpdiff's glue around it lives in kernels/, never in here."""
