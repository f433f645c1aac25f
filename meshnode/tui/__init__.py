"""The workload owner's TUI (``meshnode tui``): app.py is the Textual app and its connection
loop; screens.py the dialogs; tables.py and why.py turn control-API results into rows and
advice; form.py checks the compose form with the manifest parser."""
