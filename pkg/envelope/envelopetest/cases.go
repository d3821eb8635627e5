// Package envelopetest reads pkg/envelope/testdata/validation.json, the
// table of valid and invalid envelopes that every implementation of the
// envelope rules is checked against: envelope.Validate itself and the
// database's fifobox_enqueue (migrations/00013_enqueue_function.sql, with
// the quick checks of 00014_enqueue_fast.sql).
package envelopetest

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Table is the file: a valid base envelope (JSON field names) and cases
// that change it.
type Table struct {
	Base  map[string]any `json:"base"`
	Cases []Case         `json:"cases"`
}

// Case is one row. Field and Kind ("missing", "invalid", "too_large") are
// what the rules must report; both empty means the envelope is valid.
type Case struct {
	Name               string         `json:"name"`
	Set                map[string]any `json:"set"`
	OccurredAtYear     *int           `json:"occurred_at_year"`
	Payload            *string        `json:"payload"`
	PayloadHex         string         `json:"payload_hex"`
	PayloadDepth       int            `json:"payload_depth"`
	PayloadStringBytes int            `json:"payload_string_bytes"`
	Field              string         `json:"field"`
	Kind               string         `json:"kind"`
}

// Path is the table's location in this checkout.
func Path() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "testdata", "validation.json")
}

// Load reads the table at Path.
func Load() (Table, error) {
	raw, err := os.ReadFile(Path())
	if err != nil {
		return Table{}, fmt.Errorf("load validation table: %w", err)
	}
	var t Table
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&t); err != nil {
		return Table{}, fmt.Errorf("load validation table: %w", err)
	}
	return t, nil
}

// Kinds maps the table's kind names to envelope's sentinel errors.
var Kinds = map[string]error{"missing": envelope.ErrMissing, "invalid": envelope.ErrInvalid, "too_large": envelope.ErrTooLarge}

// Build applies c to the base envelope.
func (c Case) Build(base map[string]any) (envelope.Envelope, error) {
	f := map[string]any{}
	for k, v := range base {
		f[k] = v
	}
	for k, v := range c.Set {
		f[k] = v
	}
	str := func(k string) string { s, _ := f[k].(string); return s }
	num := func(k string) int64 {
		n, _ := f[k].(json.Number).Int64()
		return n
	}
	e := envelope.Envelope{ID: str("id"), Type: str("type"), AggregateType: str("aggregate_type"), AggregateID: str("aggregate_id"),
		Sequence: num("sequence"), TenantID: str("tenant_id"), CorrelationID: str("correlation_id"), CausationID: str("causation_id"),
		TraceParent: str("traceparent"), TraceState: str("tracestate"), SchemaVersion: int(num("schema_version")), Payload: json.RawMessage(str("payload"))}
	if s := str("occurred_at"); s != "" {
		tm, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			return envelope.Envelope{}, fmt.Errorf("case %q: occurred_at: %w", c.Name, err)
		}
		e.OccurredAt = tm
	}
	if c.OccurredAtYear != nil {
		e.OccurredAt = time.Date(*c.OccurredAtYear, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	switch {
	case c.Payload != nil:
		e.Payload = json.RawMessage(*c.Payload)
	case c.PayloadHex != "":
		b, err := hex.DecodeString(c.PayloadHex)
		if err != nil {
			return envelope.Envelope{}, fmt.Errorf("case %q: payload_hex: %w", c.Name, err)
		}
		e.Payload = b
	case c.PayloadDepth > 0:
		e.Payload = json.RawMessage(strings.Repeat("[", c.PayloadDepth) + "0" + strings.Repeat("]", c.PayloadDepth))
	case c.PayloadStringBytes > 0:
		e.Payload = json.RawMessage(`{"x":"` + strings.Repeat("a", c.PayloadStringBytes) + `"}`)
	}
	return e, nil
}
