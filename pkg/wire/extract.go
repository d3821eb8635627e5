package wire

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// KeyError is a body that lacks, or has an unusable, value the profile's
// keys say it holds. Field is the event field, Path the profile's member
// path for it.
type KeyError struct {
	Profile string
	Field   string
	Path    string
	Reason  string
}

func (e *KeyError) Error() string {
	return fmt.Sprintf("profile %s: keys.%s (%s): %s", e.Profile, e.Field, e.Path, e.Reason)
}

// Reversible reports whether a body in this profile's shape can be read
// back into an event: every field fifobox needs has a key (from the
// template, Keys or Defaults). The error names the missing key.
func (p *Profile) Reversible() error {
	var missing []string
	for _, f := range []string{"event_id", "event_type", "aggregate_type", "aggregate_id"} {
		if _, ok := p.keys[f]; !ok && p.Defaults[f] == "" {
			missing = append(missing, "keys."+f)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("profile %s: %s: the body does not say where these are; add each as a member path (or a constant under defaults)",
			p.Name, strings.Join(missing, ", "))
	}
	return nil
}

// Envelope reads a body in the profile's shape back into fifobox's
// envelope: the event id (converted from the profile's id format), type,
// aggregate, occurred-at time (now when the body has none), tenant,
// correlation, causation and trace context, and the payload (the whole
// body for a "{payload}" profile). It is how a producer whose code writes
// the system's own message shape enqueues it, and how a reader of such a
// message finds its identity. A missing or unusable value is a *KeyError
// naming the profile's key; the envelope is not validated further
// (Enqueue does that).
func (p *Profile) Envelope(body []byte) (envelope.Envelope, error) {
	if err := p.Reversible(); err != nil {
		return envelope.Envelope{}, err
	}
	var e envelope.Envelope
	get := func(f string, required bool) (string, error) {
		path, ok := p.keys[f]
		if !ok {
			return p.Defaults[f], nil
		}
		v, err := lookup(body, path)
		kerr := func(reason string) error {
			return &KeyError{Profile: p.Name, Field: f, Path: strings.Join(path, "."), Reason: reason}
		}
		switch {
		case err != nil:
			return "", kerr("the body " + err.Error())
		case isNull(v) && p.Defaults[f] != "":
			return p.Defaults[f], nil
		case isNull(v) && required:
			return "", kerr("missing in the body")
		case isNull(v):
			return "", nil
		}
		var s string
		if json.Unmarshal(v, &s) != nil {
			// A number (an integer id) reads as its digits.
			var n json.Number
			if json.Unmarshal(v, &n) != nil {
				return "", kerr("must be a string")
			}
			s = n.String()
		}
		if s == "" && required {
			return "", kerr("is empty")
		}
		return s, nil
	}
	id, err := get("event_id", true)
	if err != nil {
		return e, err
	}
	if e.ID, err = p.EventIDFormat.Stored(id); err != nil {
		return e, &KeyError{Profile: p.Name, Field: "event_id", Path: strings.Join(p.keys["event_id"], "."), Reason: err.Error()}
	}
	for _, f := range []struct {
		name     string
		dst      *string
		required bool
	}{
		{"event_type", &e.Type, true}, {"aggregate_type", &e.AggregateType, true}, {"aggregate_id", &e.AggregateID, true},
		{"tenant_id", &e.TenantID, false}, {"correlation_id", &e.CorrelationID, false},
		{"causation_id", &e.CausationID, false}, {"traceparent", &e.TraceParent, false},
	} {
		if *f.dst, err = get(f.name, f.required); err != nil {
			return e, err
		}
	}
	at, err := get("occurred_at", false)
	if err != nil {
		return e, err
	}
	e.OccurredAt = time.Now().UTC()
	if at != "" {
		t, err := time.Parse(time.RFC3339Nano, at)
		if err != nil {
			return e, &KeyError{Profile: p.Name, Field: "occurred_at", Path: strings.Join(p.keys["occurred_at"], "."), Reason: "not an RFC 3339 time"}
		}
		e.OccurredAt = t.UTC()
	}
	e.SchemaVersion = 1
	if p.body.passthrough() {
		e.Payload = append(json.RawMessage(nil), body...)
		return e, nil
	}
	path := p.payloadPath
	if path == nil {
		return e, fmt.Errorf("profile %s: the body template has no member that is exactly \"{payload}\"", p.Name)
	}
	v, err := lookup(body, path)
	if err != nil || v == nil {
		return e, &KeyError{Profile: p.Name, Field: "payload", Path: strings.Join(path, "."), Reason: "missing in the body"}
	}
	e.Payload = append(json.RawMessage(nil), v...)
	return e, nil
}
