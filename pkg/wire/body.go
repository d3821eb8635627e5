package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
)

// node is one value of a compiled body template.
type node struct {
	lit     []byte   // a literal JSON value, compact
	members []member // an object (obj true)
	obj     bool
	items   []node // an array (arr true)
	arr     bool
	tpl     template // a string with references
	whole   bool     // tpl is exactly one reference: the value keeps its type
	cols    []string // a source template's column (pkg/wire Source)
}

type member struct {
	key   []byte // the member name as a JSON string
	value node
}

// compileBody parses a profile's body template. at is the profile path for
// errors ("body").
func compileBody(raw json.RawMessage, at string) (node, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return node{}, fmt.Errorf("%s: required: a JSON template of the message body, or \"{payload}\"", at)
	}
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	n, err := compileValue(d, at)
	if err != nil {
		return node{}, err
	}
	if _, err := d.Token(); err != io.EOF {
		return node{}, fmt.Errorf("%s: data after the template", at)
	}
	return n, nil
}

func compileValue(d *json.Decoder, at string) (node, error) {
	tok, err := d.Token()
	if err != nil {
		return node{}, fmt.Errorf("%s: %w", at, err)
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			n := node{obj: true}
			seen := map[string]bool{}
			for d.More() {
				kt, err := d.Token()
				if err != nil {
					return node{}, fmt.Errorf("%s: %w", at, err)
				}
				k := kt.(string)
				if seen[k] {
					return node{}, fmt.Errorf("%s.%s: appears twice", at, k)
				}
				seen[k] = true
				val, err := compileValue(d, at+"."+k)
				if err != nil {
					return node{}, err
				}
				n.members = append(n.members, member{key: appendString(nil, k), value: val})
			}
			_, err := d.Token() // '}'
			return n, err
		case '[':
			n := node{arr: true}
			for i := 0; d.More(); i++ {
				val, err := compileValue(d, fmt.Sprintf("%s[%d]", at, i))
				if err != nil {
					return node{}, err
				}
				if val.tpl.optional {
					return node{}, fmt.Errorf("%s[%d]: '?' leaves out an object member; an array item cannot be left out", at, i)
				}
				n.items = append(n.items, val)
			}
			_, err := d.Token() // ']'
			return n, err
		}
	case string:
		if !strings.ContainsAny(v, "{}") {
			return node{lit: appendString(nil, v)}, nil
		}
		t, err := parseTemplate(v)
		if err != nil {
			return node{}, fmt.Errorf("%s: %v", at, err)
		}
		_, whole := t.single()
		return node{tpl: t, whole: whole}, nil
	case json.Number:
		return node{lit: []byte(v.String())}, nil
	case bool:
		if v {
			return node{lit: []byte("true")}, nil
		}
		return node{lit: []byte("false")}, nil
	case nil:
		return node{lit: []byte("null")}, nil
	}
	return node{}, fmt.Errorf("%s: unexpected %v", at, tok)
}

// render appends the value for e.
func (n *node) render(dst []byte, e *event) ([]byte, error) {
	switch {
	case n.lit != nil:
		return append(dst, n.lit...), nil
	case n.obj:
		dst = append(dst, '{')
		first := true
		for i := range n.members {
			m := &n.members[i]
			if m.value.tpl.optional {
				p, _ := m.value.tpl.single()
				v, err := p.resolve(e)
				if err != nil {
					return nil, err
				}
				if v.empty() {
					continue
				}
			}
			if !first {
				dst = append(dst, ',')
			}
			first = false
			dst = append(dst, m.key...)
			dst = append(dst, ':')
			var err error
			if dst, err = m.value.render(dst, e); err != nil {
				return nil, err
			}
		}
		return append(dst, '}'), nil
	case n.arr:
		dst = append(dst, '[')
		for i := range n.items {
			if i > 0 {
				dst = append(dst, ',')
			}
			var err error
			if dst, err = n.items[i].render(dst, e); err != nil {
				return nil, err
			}
		}
		return append(dst, ']'), nil
	case n.whole:
		p, _ := n.tpl.single()
		v, err := p.resolve(e)
		if err != nil {
			return nil, err
		}
		return v.appendJSON(dst), nil
	}
	s, err := n.tpl.render(e)
	if err != nil {
		return nil, err
	}
	return appendString(dst, s), nil
}

// refs lists every reference in the template.
func (n *node) refs() []ref {
	var out []ref
	for i := range n.members {
		out = append(out, n.members[i].value.refs()...)
	}
	for i := range n.items {
		out = append(out, n.items[i].refs()...)
	}
	return append(out, n.tpl.refs()...)
}

// passthrough reports whether the body is exactly "{payload}".
func (n *node) passthrough() bool {
	p, ok := n.tpl.single()
	return n.whole && ok && len(p.alts) == 1 && p.alts[0].f.name == "payload" && p.alts[0].path == nil
}

// paths maps each field that a member holds exactly (a whole, single,
// non-alternative reference) to that member's path in the body, e.g.
// aggregate_id -> [key transferId]: where a reader of the body finds it.
func (n *node) paths() map[string][]string {
	out := map[string][]string{}
	var walk func(n *node, at []string)
	walk = func(n *node, at []string) {
		for i := range n.members {
			m := &n.members[i]
			var k string
			_ = json.Unmarshal(m.key, &k)
			walk(&m.value, append(append([]string(nil), at...), k))
		}
		if p, ok := n.tpl.single(); ok && n.whole && len(p.alts) == 1 && p.alts[0].path == nil {
			name := p.alts[0].f.name
			if _, dup := out[name]; !dup && at != nil {
				out[name] = at
			}
		}
	}
	walk(n, nil)
	return out
}

var errNotObject = errors.New("is not a JSON object")

// lookup returns the JSON value at path in body (nil when absent).
func lookup(body []byte, path []string) ([]byte, error) {
	v := json.RawMessage(body)
	for _, name := range path {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(v, &m); err != nil {
			return nil, errNotObject
		}
		var ok bool
		if v, ok = m[name]; !ok {
			return nil, nil
		}
	}
	return v, nil
}
