"""The lab: noise injection, synthetic worlds, COCO builders, the demo."""
