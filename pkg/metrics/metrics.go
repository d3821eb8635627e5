// Package metrics writes CloudWatch metrics as Embedded Metric Format (EMF)
// log lines: one JSON object per line on stdout, which CloudWatch Logs turns
// into metrics without any API call from the Lambda. Each line carries a root
// "_aws" object (Timestamp, CloudWatchMetrics with Namespace, Dimensions and
// the metric names and units) and the dimension and metric values as
// top-level keys.
//
// Only counts, durations and names of fifobox components are emitted: never
// payloads, aggregate ids or anything that could be personal data.
package metrics

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
)

// Unit is a CloudWatch metric unit.
type Unit string

// Units used by fifobox.
const (
	Count        Unit = "Count"
	Seconds      Unit = "Seconds"
	Milliseconds Unit = "Milliseconds"
)

// DefaultNamespace is used when FIFOBOX_METRICS_NAMESPACE is unset.
const DefaultNamespace = "Fifobox"

// Metric is one named value. Values holds several samples of one metric
// (EMF allows up to 100 per line); Value is used when Values is empty.
type Metric struct {
	Name   string
	Unit   Unit
	Value  float64
	Values []float64
}

// Emitter writes EMF lines to a writer. It is safe for concurrent use.
type Emitter struct {
	namespace string
	mu        sync.Mutex
	w         io.Writer
	// Now is the clock for Timestamp; tests may replace it.
	Now func() time.Time
}

// New returns an Emitter writing to w under namespace (DefaultNamespace if empty).
func New(w io.Writer, namespace string) *Emitter {
	if namespace == "" {
		namespace = DefaultNamespace
	}
	return &Emitter{namespace: namespace, w: w, Now: time.Now}
}

// Env is every variable FromEnv reads (the Lambda runtime contract tests
// check the CDK template against it).
var Env = envspec.Set{
	{Name: "FIFOBOX_METRICS_NAMESPACE", Doc: "CloudWatch namespace of the EMF metrics (default Fifobox)"},
}

// FromEnv returns an Emitter writing to stdout with the namespace from
// FIFOBOX_METRICS_NAMESPACE (default "Fifobox").
func FromEnv() *Emitter { return New(os.Stdout, Env.Get("FIFOBOX_METRICS_NAMESPACE")) }

// Namespace returns the CloudWatch namespace.
func (e *Emitter) Namespace() string { return e.namespace }

// maxSamples is EMF's limit of values per metric per line.
const maxSamples = 100

// Emit writes one EMF line with the given dimensions (one dimension set made
// of all keys) and metrics. Non-finite values are dropped (CloudWatch rejects
// them); metrics with more than 100 samples keep the last 100.
func (e *Emitter) Emit(dims map[string]string, ms ...Metric) error {
	if e == nil {
		return nil
	}
	if len(ms) == 0 {
		return errors.New("metrics: nothing to emit")
	}
	if len(dims) > 30 {
		return errors.New("metrics: more than 30 dimensions")
	}
	keys := make([]string, 0, len(dims))
	for k := range dims {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	line := map[string]any{}
	for k, v := range dims {
		line[k] = v
	}
	type def struct {
		Name string `json:"Name"`
		Unit Unit   `json:"Unit,omitempty"`
	}
	defs := make([]def, 0, len(ms))
	for _, m := range ms {
		if m.Name == "" || m.Name == "_aws" {
			return fmt.Errorf("metrics: invalid metric name %q", m.Name)
		}
		if _, clash := dims[m.Name]; clash {
			return fmt.Errorf("metrics: metric %q has the name of a dimension", m.Name)
		}
		var v any
		if len(m.Values) > 0 {
			vals := make([]float64, 0, len(m.Values))
			for _, x := range m.Values {
				if !math.IsNaN(x) && !math.IsInf(x, 0) {
					vals = append(vals, x)
				}
			}
			if len(vals) > maxSamples {
				vals = vals[len(vals)-maxSamples:]
			}
			if len(vals) == 0 {
				continue
			}
			v = vals
		} else {
			if math.IsNaN(m.Value) || math.IsInf(m.Value, 0) {
				continue
			}
			v = m.Value
		}
		line[m.Name] = v
		defs = append(defs, def{Name: m.Name, Unit: m.Unit})
	}
	if len(defs) == 0 {
		return nil
	}
	line["_aws"] = map[string]any{
		"Timestamp": e.Now().UnixMilli(),
		"CloudWatchMetrics": []map[string]any{{
			"Namespace":  e.namespace,
			"Dimensions": [][]string{keys},
			"Metrics":    defs,
		}},
	}
	b, err := json.Marshal(line)
	if err != nil {
		return fmt.Errorf("metrics: encode: %w", err)
	}
	b = append(b, '\n')
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := e.w.Write(b); err != nil {
		return fmt.Errorf("metrics: write: %w", err)
	}
	return nil
}
