// Package envspec declares the environment variables a component reads at
// start, in one list that the component's loader reads through. The
// deployment that sets them (the CDK template) is checked against these lists
// (functions/runtimetest), so a variable CDK misspells, forgets or sets for
// nobody fails a test instead of a Lambda init in someone's AWS account.
//
// A loader declares its variables once and reads them with Get:
//
//	var Env = envspec.Set{
//		{Name: "FIFOBOX_TOPIC_ARN", Required: true, Doc: "the SNS FIFO topic's ARN"},
//		{Name: "FIFOBOX_BATCH_SIZE", Doc: "claim batch size (default 500)"},
//	}
//	arn := Env.Get("FIFOBOX_TOPIC_ARN")
//
// Get panics on a name the set does not declare: reading an undeclared
// variable is a programming error, found by the first test that loads the
// configuration.
package envspec

import (
	"fmt"
	"os"
	"slices"
)

// Var is one environment variable.
type Var struct {
	// Name is the variable's name.
	Name string
	// Required: the component refuses to start without it (its loader fails
	// with an error naming the variable).
	Required bool
	// Reserved: the platform sets it (Lambda sets AWS_REGION, for example); a
	// deployment must not.
	Reserved bool
	// Doc says what the value is and its default.
	Doc string
}

// Set is the variables one loader reads.
type Set []Var

// Get returns the value of the declared variable name ("" if unset).
func (s Set) Get(name string) string {
	if _, ok := s.Lookup(name); !ok {
		panic(fmt.Sprintf("envspec: %s is read but not declared in this loader's Set", name))
	}
	return os.Getenv(name)
}

// Lookup returns the declaration of name.
func (s Set) Lookup(name string) (Var, bool) {
	i := slices.IndexFunc(s, func(v Var) bool { return v.Name == name })
	if i < 0 {
		return Var{}, false
	}
	return s[i], true
}

// Names returns the declared names in order.
func (s Set) Names() []string {
	out := make([]string, len(s))
	for i, v := range s {
		out[i] = v.Name
	}
	return out
}

// Join concatenates sets (a function's own variables and those of the
// shared loaders it calls). A name declared twice keeps its first
// declaration.
func Join(sets ...Set) Set {
	var out Set
	for _, s := range sets {
		for _, v := range s {
			if _, dup := out.Lookup(v.Name); !dup {
				out = append(out, v)
			}
		}
	}
	return out
}
