from fastdeploy_core.cli.main import main

main()
