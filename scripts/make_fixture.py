"""Make a tiny Kimi-shaped checkpoint (kconvert.testing.fixtures says what each variant is).

    python scripts/make_fixture.py OUT_DIR --variant k2-int4-kimi [--seed 0] [--hidden 128]
        [--experts 16] [--moe-layers 2] [--moe-intermediate 64] [--mtp-layers 1]
        [--overwrite]
"""

from kconvert.testing.fixtures import main

if __name__ == "__main__":
    main()



