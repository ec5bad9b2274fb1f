from grpo_stream.gpu_check.run import main

raise SystemExit(main())
