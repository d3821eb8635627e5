package wire

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// Source is where a system's producers already write their events: their
// own outbox table, unchanged. Each event field names where the row holds
// it: a column ("aggregate_id"), a member of a json or jsonb column
// ("payload.key.transferId"), or alternatives ("resource_id|tenant_id", the
// first that is not null). pkg/capture checks it against the database
// (the table, the columns and their types, a unique event id) before
// anything is installed.
type Source struct {
	// Table is the producers' outbox table, optionally schema-qualified.
	Table string `json:"table"`
	// EventID is the event's id: a uuid column, a text column holding an
	// id in the profile's event_id_format, or a member of a json column. A
	// column must be unique (its primary key or a unique index on it
	// alone).
	EventID       string `json:"event_id"`
	EventType     string `json:"event_type"`
	AggregateType string `json:"aggregate_type,omitempty"`
	AggregateID   string `json:"aggregate_id"`
	OccurredAt    string `json:"occurred_at,omitempty"`
	TenantID      string `json:"tenant_id,omitempty"`
	CorrelationID string `json:"correlation_id,omitempty"`
	CausationID   string `json:"causation_id,omitempty"`
	TraceParent   string `json:"traceparent,omitempty"`
	// Payload is what becomes the event's payload: a reference like the
	// fields', or a JSON template over the row's columns ({"event_id":
	// "{id}", "payload": "{payload}"}) that builds the body a "{payload}"
	// profile publishes.
	Payload json.RawMessage `json:"payload"`
	// Status, if set, keeps the table's own status columns telling the
	// truth once fifobox has published an event (sent) or given up on it
	// (dead). pkg/capture installs it with the capture.
	Status *SourceStatus `json:"status,omitempty"`

	refs    map[string][]ColumnRef
	payload node // template over columns, when Payload is an object
}

// ColumnRef is one place in a row: a column, and a path into it when the
// column is json or jsonb.
type ColumnRef struct {
	Column string
	Path   []string
}

func (r ColumnRef) String() string {
	if len(r.Path) == 0 {
		return r.Column
	}
	return r.Column + "." + strings.Join(r.Path, ".")
}

var (
	sourceTableRE  = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_$]{0,62}\.)?[A-Za-z_][A-Za-z0-9_$]{0,62}$`)
	sourceColumnRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_$]{0,62}$`)
)

// parseColumnRefs parses "col", "col.a.b" or "a|b".
func parseColumnRefs(s string) ([]ColumnRef, error) {
	var out []ColumnRef
	for _, alt := range strings.Split(s, "|") {
		parts := strings.Split(strings.TrimSpace(alt), ".")
		if !sourceColumnRE.MatchString(parts[0]) {
			return nil, fmt.Errorf("%q: a column name, or column.member... for a json column", alt)
		}
		for _, p := range parts[1:] {
			if p == "" {
				return nil, fmt.Errorf("%q: an empty member name", alt)
			}
		}
		out = append(out, ColumnRef{Column: parts[0], Path: parts[1:]})
	}
	return out, nil
}

// SourceStatus sets columns of the producer's row when its event changes
// state in fifobox. Each key is a column or a member of a json or jsonb
// column ("payload.outbox_status"); each value a JSON literal ("published",
// true, 3) or one of the values fifobox knows then: "{now}", "{attempts}"
// (publish attempts so far), "{last_error}".
type SourceStatus struct {
	Sent map[string]json.RawMessage `json:"sent"`
	Dead map[string]json.RawMessage `json:"dead,omitempty"`
}

// StatusValues are the placeholders a status value can be.
var StatusValues = []string{"{now}", "{attempts}", "{last_error}"}

// StatusSet is one assignment of a status section: Target is where,
// Value a JSON literal, or Placeholder one of StatusValues.
type StatusSet struct {
	Target      ColumnRef
	Value       json.RawMessage
	Placeholder string
}

// StatusSets returns the assignments for fifobox's state "sent" or "dead",
// in target order.
func (s *Source) StatusSets(state string) []StatusSet {
	if s.Status == nil {
		return nil
	}
	m := s.Status.Sent
	if state == "dead" {
		m = s.Status.Dead
	}
	out := make([]StatusSet, 0, len(m))
	for _, k := range sortedKeys(m) {
		refs, _ := parseColumnRefs(k)
		set := StatusSet{Target: refs[0], Value: m[k]}
		var ph string
		if json.Unmarshal(m[k], &ph) == nil && slicesContain(StatusValues, ph) {
			set.Placeholder, set.Value = ph, nil
		}
		out = append(out, set)
	}
	return out
}

func (st *SourceStatus) prepare(at string) []error {
	var errs []error
	if len(st.Sent) == 0 {
		errs = append(errs, fmt.Errorf("%s.sent: required: the columns to set once an event is published", at))
	}
	for _, part := range []struct {
		name string
		m    map[string]json.RawMessage
	}{{"sent", st.Sent}, {"dead", st.Dead}} {
		for _, k := range sortedKeys(part.m) {
			refs, err := parseColumnRefs(k)
			if err == nil && len(refs) > 1 {
				err = fmt.Errorf("%q: one column or json member, no alternatives", k)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.%s[%q]: %v", at, part.name, k, err))
				continue
			}
			v := bytes.TrimSpace(part.m[k])
			var val any
			if err := json.Unmarshal(v, &val); err != nil {
				errs = append(errs, fmt.Errorf("%s.%s[%q]: %v", at, part.name, k, err))
				continue
			}
			switch x := val.(type) {
			case string:
				if strings.ContainsAny(x, "{}") && !slicesContain(StatusValues, x) {
					errs = append(errs, fmt.Errorf("%s.%s[%q]: %q: a literal, or one of %s", at, part.name, k, x, strings.Join(StatusValues, ", ")))
				}
			case map[string]any, []any, nil:
				errs = append(errs, fmt.Errorf("%s.%s[%q]: a string, number or boolean", at, part.name, k))
			}
		}
	}
	return errs
}

// prepare checks the section's syntax (the database checks are pkg/capture's).
func (s *Source) prepare(at string, defaults map[string]string) []error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if !sourceTableRE.MatchString(s.Table) {
		add("%s.table %q: a table name, optionally schema-qualified", at, s.Table)
	}
	s.refs = map[string][]ColumnRef{}
	for _, f := range s.fields() {
		if *f.v == "" {
			switch {
			case f.required:
				add("%s.%s: required: the column (or json member) holding the %s", at, f.name, strings.ReplaceAll(f.name, "_", " "))
			case f.name == "aggregate_type" && defaults["aggregate_type"] == "":
				add("%s.aggregate_type: required (or defaults.aggregate_type): fifobox orders events per aggregate type and id", at)
			}
			continue
		}
		refs, err := parseColumnRefs(*f.v)
		if err != nil {
			add("%s.%s: %v", at, f.name, err)
			continue
		}
		s.refs[f.name] = refs
	}
	raw := bytes.TrimSpace(s.Payload)
	switch {
	case len(raw) == 0:
		add("%s.payload: required: a column (\"payload\"), a json member, or a JSON template over the columns", at)
	case raw[0] == '"':
		var ref string
		_ = json.Unmarshal(raw, &ref)
		refs, err := parseColumnRefs(ref)
		if err != nil {
			add("%s.payload: %v", at, err)
		}
		s.refs["payload"] = refs
	default:
		n, err := compileColumnTemplate(raw, at+".payload")
		if err != nil {
			errs = append(errs, err)
		}
		s.payload = n
	}
	if s.Status != nil {
		errs = append(errs, s.Status.prepare(at+".status")...)
	}
	return errs
}

type sourceField struct {
	name     string
	v        *string
	required bool
}

func (s *Source) fields() []sourceField {
	return []sourceField{
		{"event_id", &s.EventID, true}, {"event_type", &s.EventType, true}, {"aggregate_type", &s.AggregateType, false},
		{"aggregate_id", &s.AggregateID, true}, {"occurred_at", &s.OccurredAt, false}, {"tenant_id", &s.TenantID, false},
		{"correlation_id", &s.CorrelationID, false}, {"causation_id", &s.CausationID, false}, {"traceparent", &s.TraceParent, false},
	}
}

// Refs returns the row references of each event field (and "payload" when
// the payload is a reference), as parsed.
func (s *Source) Refs() map[string][]ColumnRef { return s.refs }

// PayloadColumns lists the columns a payload template reads, in order of
// first use (nil when the payload is a reference).
func (s *Source) PayloadColumns() []string {
	var out []string
	seen := map[string]bool{}
	var walk func(n *node)
	walk = func(n *node) {
		for i := range n.members {
			walk(&n.members[i].value)
		}
		for i := range n.items {
			walk(&n.items[i])
		}
		for _, c := range n.cols {
			if !seen[c] {
				seen[c] = true
				out = append(out, c)
			}
		}
	}
	walk(&s.payload)
	return out
}

// compileColumnTemplate compiles a JSON template whose references are
// column names: "{id}" is the column's value as JSON.
func compileColumnTemplate(raw []byte, at string) (node, error) {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	return compileColumnValue(d, at)
}

func compileColumnValue(d *json.Decoder, at string) (node, error) {
	tok, err := d.Token()
	if err != nil {
		return node{}, fmt.Errorf("%s: %w", at, err)
	}
	switch v := tok.(type) {
	case json.Delim:
		if v == '[' {
			return node{}, fmt.Errorf("%s: arrays are not supported in a source template", at)
		}
		n := node{obj: true}
		for d.More() {
			kt, err := d.Token()
			if err != nil {
				return node{}, fmt.Errorf("%s: %w", at, err)
			}
			k := kt.(string)
			val, err := compileColumnValue(d, at+"."+k)
			if err != nil {
				return node{}, err
			}
			n.members = append(n.members, member{key: appendString(nil, k), value: val})
		}
		_, err := d.Token()
		return n, err
	case string:
		name, ok := strings.CutPrefix(v, "{")
		if name, ok2 := strings.CutSuffix(name, "}"); ok && ok2 {
			if !sourceColumnRE.MatchString(name) {
				return node{}, fmt.Errorf("%s: {%s}: a column name", at, name)
			}
			return node{cols: []string{name}}, nil
		}
		if strings.ContainsAny(v, "{}") {
			return node{}, fmt.Errorf("%s: %q: a source template value is a literal or exactly one {column}", at, v)
		}
		return node{lit: appendString(nil, v)}, nil
	case json.Number:
		return node{lit: []byte(v.String())}, nil
	case bool, nil:
		b, _ := json.Marshal(v)
		return node{lit: b}, nil
	}
	return node{}, fmt.Errorf("%s: unexpected %v", at, tok)
}

// PayloadTemplate walks the payload template for SQL generation: obj is
// called for each object's members in order, with either a literal JSON
// value or a column name.
func (s *Source) PayloadTemplate() *TemplateNode {
	if !s.payload.obj {
		return nil
	}
	return toTemplateNode(&s.payload)
}

// TemplateNode is a source payload template: an object of members, a
// column, or a literal JSON value.
type TemplateNode struct {
	Members []TemplateMember
	Column  string
	Literal json.RawMessage
}

// TemplateMember is one member of an object template.
type TemplateMember struct {
	Name  string
	Value *TemplateNode
}

func toTemplateNode(n *node) *TemplateNode {
	switch {
	case n.obj:
		t := &TemplateNode{}
		for i := range n.members {
			var name string
			_ = json.Unmarshal(n.members[i].key, &name)
			t.Members = append(t.Members, TemplateMember{Name: name, Value: toTemplateNode(&n.members[i].value)})
		}
		return t
	case len(n.cols) == 1:
		return &TemplateNode{Column: n.cols[0]}
	}
	return &TemplateNode{Literal: n.lit}
}
