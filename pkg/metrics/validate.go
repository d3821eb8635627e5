package metrics

import (
	"encoding/json"
	"fmt"
)

// Validate checks that line is a well-formed EMF log line: a JSON object
// with a root "_aws" holding a numeric Timestamp and a non-empty
// CloudWatchMetrics array, each entry with a Namespace, Dimensions whose keys
// are present as top-level strings, and Metrics whose every Name is present
// as a top-level number or array of numbers. It returns the parsed line.
// Tests of every fifobox component that emits metrics use it.
func Validate(line []byte) (map[string]any, error) {
	var root map[string]any
	if err := json.Unmarshal(line, &root); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	awsv, ok := root["_aws"].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("no root _aws object")
	}
	if _, ok := awsv["Timestamp"].(float64); !ok {
		return nil, fmt.Errorf("_aws.Timestamp is not a number")
	}
	cwms, ok := awsv["CloudWatchMetrics"].([]any)
	if !ok || len(cwms) == 0 {
		return nil, fmt.Errorf("_aws.CloudWatchMetrics is not a non-empty array")
	}
	for i, x := range cwms {
		d, ok := x.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("CloudWatchMetrics[%d] is not an object", i)
		}
		if ns, _ := d["Namespace"].(string); ns == "" {
			return nil, fmt.Errorf("CloudWatchMetrics[%d].Namespace missing", i)
		}
		sets, ok := d["Dimensions"].([]any)
		if !ok {
			return nil, fmt.Errorf("CloudWatchMetrics[%d].Dimensions is not an array", i)
		}
		for _, s := range sets {
			keys, ok := s.([]any)
			if !ok || len(keys) > 30 {
				return nil, fmt.Errorf("CloudWatchMetrics[%d]: a dimension set is not an array of at most 30 keys", i)
			}
			for _, k := range keys {
				ks, _ := k.(string)
				if _, ok := root[ks].(string); !ok {
					return nil, fmt.Errorf("dimension %v has no top-level string value", k)
				}
			}
		}
		ms, ok := d["Metrics"].([]any)
		if !ok || len(ms) == 0 || len(ms) > 100 {
			return nil, fmt.Errorf("CloudWatchMetrics[%d].Metrics: want 1-100 definitions", i)
		}
		for _, m := range ms {
			md, _ := m.(map[string]any)
			name, _ := md["Name"].(string)
			if name == "" {
				return nil, fmt.Errorf("metric definition without Name")
			}
			switch v := root[name].(type) {
			case float64:
			case []any:
				if len(v) == 0 || len(v) > 100 {
					return nil, fmt.Errorf("metric %s: want 1-100 values", name)
				}
				for _, e := range v {
					if _, ok := e.(float64); !ok {
						return nil, fmt.Errorf("metric %s: non-numeric value %v", name, e)
					}
				}
			default:
				return nil, fmt.Errorf("metric %s is not present as a number", name)
			}
		}
	}
	return root, nil
}
